"""The engine alone: throughput beside the roofline and transformers, paired kernel A/Bs,
attention's share, tensor parallelism, structured output."""
