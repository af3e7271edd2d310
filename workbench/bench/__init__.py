"""Benchmarks: what the fixed kernel costs against the attention a torch user can pick.

Runners measure and print; reports read records (on any machine) and judge them; each pair
shares the record's vocabulary, so dependencies point one way: runner -> report -> record.

- `kernels`: the kernel benchmark (forward and backward, per workload, side by side);
  `kernel_record`: its rows and record; `kernel_report`: what a run means against the targets;
- `stepbench`: the training step a user of the swap pays for; `step_record`, `step_report`: the same for it;
- `verdict`: targets and time cells the reports share; `hopper_report`: the forward kernel's Hopper switches;
- `workloads`: the packed batches they run on.
"""
