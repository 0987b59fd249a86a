"""The Triton kernels of a decode step, each with its torch twin.

- `loader`: Triton loaded lazily (`load`, `jit`), `triton_available()`, `runs_on(device)` (a
  kernel, or its twin?), the interpreter's checks and patch, and what the kernel modules share
  (`dot_dtype`, `addressable`: a slab on the device or in pinned host memory).
- `decode`: paged decode attention (`paged_decode`: per-(sequence, KV head) block lists read
  where they live, HBM or pinned DDR, split + log-sum-exp merge; `choose_block_split`), and its
  twin `torch_paged_decode`.
- `copies`: `paged_write` (new K/V into HBM or pinned DDR in place) and `copy_blocks` (whole
  blocks between pools).
- `fused`: the decoder's small ops fused, `add_rms_norm` (residual add + RMSNorm) and `rotary`
  (RoPE).
- `probe`: HBF's prompt probe (`key_mass`: the attention mass each key draws from a prompt's
  last queries, without the scores in memory); its twin is in `h3d.hbf.policy.probe_anchors`.
- `select`: HBF's selection inside a captured decode step (`scores`, `top_room`, `lists`,
  `fold`); its twin is `h3d.hbf.policy.select_static`.

Every kernel has a torch twin, which runs on a CPU without Triton's interpreter or without
Triton; the tests run the kernels on the CPU under `TRITON_INTERPRET=1` and compare them with
their twins (and paged decode with a float64 oracle). The package imports without Triton
installed: Triton is imported at the first launch (`h3d.kernels.loader`).
"""
