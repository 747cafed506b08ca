"""Prefill/decode disaggregation in the control plane: which rows a handoff moves and how they
are checked, the decode engine's scheduler, and the decode and prefill cores. The handoff
messages themselves are ``engine/handoff.py``, which step plans carry."""
