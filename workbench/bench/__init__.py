"""Benchmarks: what the fixed kernel costs against the attention a torch user can pick.

- `kernels`: the kernel benchmark (forward and backward, per workload, side by side);
- `stepbench`: the training step a user of the swap pays for;
- `report`: what a run means against the performance targets;
- `workloads`: the packed batches they run on; `hopper_report`: the forward kernel's Hopper switches.
"""
