"""Running a validated step on the device: its batch laid out on the host
(batch.py) and uploaded in one copy (upload.py), the forward (eager, or a
captured decode graph: cuda_graphs.py), sampling, and the one piece of state
kept between steps (last_samples.py). model_runner.py ties them together;
warm_up.py and memory.py are what a worker does with a runner before serving."""
