"""What the prefill and decode services share: the engine thread and the worker options."""
