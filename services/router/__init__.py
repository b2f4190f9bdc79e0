"""The router: model and lane choice, forwarding to the prefill pool (policy in policy.py)."""
