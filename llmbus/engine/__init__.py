"""The inference engine: sequences, block manager, scheduler, runner, sampler."""
