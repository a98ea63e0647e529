"""The scaling planner's model, below the run: what a step of N GPUs costs (plan_model), the published systems
and runs it is checked against (plan_published, plan_band), and a config's workload and buckets (plan_workload).
The run reads it to size `distribute.pack_bytes=auto`; `tfscale-plan` (tfscale.perf.plan) prints it."""
