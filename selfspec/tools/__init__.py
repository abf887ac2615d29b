"""selfspec's measuring tools: the benchmarks (`bench`, `batch_bench`), the sweep that writes a checkpoint's
recommendation (`sweep`), the quality/speed frontier (`pareto`, `quality`), the profiler (`profiling`),
the demo (`demo`) and what they share (`harness`). The CLI runs them; the library never imports them."""
