"""The systems under test, one module each, all behind `benchmarks.systems.base.System`."""
