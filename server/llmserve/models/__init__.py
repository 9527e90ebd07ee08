"""Models: a path or a package's name turned into a loaded model (engine/types/model.py's LoadedModel), everything
the engine serves a model from.

- `loader.py`: `load_model` (the bundled default GGUF, any GGUF, a transformers folder, a packaged model by name,
  random weights in a known shape: `random_shapes.py`), the device and dtype picked for this machine;
- `gguf_file.py` (a GGUF's header, its tensors mapped), `gguf_model.py` (a transformers model over a GGUF's blocks,
  never dequantized), `gguf.py` (the default GGUF, display names, the tokenizer and config, or the whole model
  dequantized, cached once);
- `packaged.py` (models zipped in Python packages, extracted once), `cache.py` (the cache folders both make once);
- `pooling_config.py`: what a folder says about pooling and classification (sentence-transformers' files, a
  classifier's labels);
- `encoder.py` (the BERT family's forward over packed rows) and `classifier.py` (sequence-classification heads).

It imports the kernels it builds on from engine/backends/cpu/ (the GGUF block kernels, the packed and split float32
linears); no layer of the engine imports it but the code that loads a model (the engine process, core/process.py).
`python -m llmserve.models` loads a model as a CPU server would, making its caches once (`make model`).
"""
