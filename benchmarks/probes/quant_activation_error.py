"""What quantizing activations per block of 32 (quant.QuantLinear's scheme, llama.cpp's Q8_0) adds to each linear's
error on the default model's own weights and activations (issue 42).

The default GGUF's Q4_1 linears and its Q8_0 token embedding (the tied LM head) are run on the inputs each linear
sees while the float32 model (the dequantized copy in the cache) reads the first tokens of tests/data/perplexity.txt.
Each output is compared with float64 x @ W.T over the same dequantized weights: relative error ||y - ref|| / ||ref||
of QuantLinear and, for scale, of float32 torch; and the share of tokens whose LM-head argmax is unchanged.

    python benchmarks/probes/quant_activation_error.py --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

from llmserve.process_settings import configure_process  # noqa: E402

configure_process()

import gguf  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from llmserve.engine.backends.cpu import quant as q  # noqa: E402
from llmserve.models.gguf import convert_gguf, default_gguf_path  # noqa: E402

TEXT = ROOT / "tests" / "data" / "perplexity.txt"
# transformers' module name -> the GGUF tensor name's tail
NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    path = default_gguf_path()
    folder = convert_gguf(path)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt").input_ids[:, : args.tokens]

    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(lambda m, a, o, n=name: inputs.__setitem__(n, a[0][0].detach())))
    with torch.inference_mode():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()

    errors: dict[str, list[tuple[float, float]]] = defaultdict(list)
    agree = None
    for name, x in inputs.items():
        if name == "lm_head":
            tensor, kind = tensors["token_embd.weight"], "head"
        else:
            layer = name.split(".")[2]
            kind = NAMES[name.split(".", 3)[3]]
            tensor = tensors[f"blk.{layer}.{kind}.weight"]
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        w = q.QuantWeight(q.GGMLType(int(tensor.tensor_type)), rows, cols, torch.from_numpy(tensor.data.copy()))
        dense = q.dequantize(w)
        x = x.contiguous()
        ref = x.double() @ dense.double().T
        ours = q.QuantLinear(w)(x).double()
        plain = torch.nn.functional.linear(x, dense).double()
        errors[kind].append((float((ours - ref).norm() / ref.norm()), float((plain - ref).norm() / ref.norm())))
        if kind == "head":
            agree = float((ours.argmax(-1) == ref.argmax(-1)).double().mean())
    print(f"# {path.name}, {ids.shape[1]} tokens of {TEXT.name}, kernel level {q.kernel_level()}")
    print("| linear | type | relative error, quantized activations (median / max over layers) | float32 torch |")
    print("|---|---|---|---|")
    for kind, pairs in errors.items():
        ours_err = [p[0] for p in pairs]
        plain_err = [p[1] for p in pairs]
        kind_name = "Q8_0" if kind == "head" else "Q4_1"
        print(
            f"| {kind} | {kind_name} | {statistics.median(ours_err):.2e} / {max(ours_err):.2e} "
            f"| {statistics.median(plain_err):.1e} / {max(plain_err):.1e} |"
        )
    print(f"LM head argmax unchanged on {agree:.1%} of tokens (same hidden states)")


if __name__ == "__main__":
    main()
