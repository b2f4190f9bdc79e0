"""llmbus: an LLM inference service over NATS JetStream."""

__version__ = "0.1.0"
