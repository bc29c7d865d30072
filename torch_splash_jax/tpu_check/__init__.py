"""The real-chip check of torch_splash's JAX side: `python -m torch_splash_jax.tpu_check` on a TPU
host (JAX only; torch_xla or TorchTPU, where installed, add the torch bridge's run).

- cases.py: the fidelity cases, the timing rows, a user's `--shape` / `--mask`;
- reference.py: the float32 reference at `highest` precision, and the inputs;
- baselines.py: JAX's splash at MaxText's blocks, XLA's dense attention, paged attention;
- chip.py: the process that holds the chip and measures;
- __main__.py: the command, its processes and its results file.

Nothing on the attention path imports this package (tests/test_layering.py).
"""
