"""Overlap scheduling: a decode's next token is scheduled while its last one is still computed.

With two plans in flight on one stage, plan n + 1 is built and submitted while the device runs
plan n, so the host's work (scheduling, batch indices, commit, detokenisation) hides behind the
forward. A running request R whose step n samples its next token t (at position p = R.num_tokens)
gets a lookahead entry in plan n + 1: one token at p, whose id the last stage takes from plan
n's sampled ids on the device (plan n + 1's token_ids holds LOOKAHEAD_TOKEN there).

Bookkeeping stays in the one request model: R.lookahead_step is plan n + 1 while R.in_flight_step
is plan n; commit(n) appends t and promotes the lookahead step to the one in flight. If t ends R
(eos, a stop token or string, an abort), R is released at commit(n) and plan n + 1's entry for it
is skipped at commit(n + 1), as for any request that ends while its step runs: its writes went to
ids that only later plans can reuse, since stages apply plans in order. A lookahead is never
scheduled where t is already known to be R's last (max_tokens, max_model_len), nor beside drafts.
"""

from __future__ import annotations

from dsv4ray.engine.request import Request, Status


def can_look_ahead(req: Request, max_model_len: int) -> bool:
    """R's only step in flight samples a token that will not be its last by length."""
    return (
        req.status is Status.RUNNING
        and req.in_flight_step is not None
        and req.lookahead_step is None
        and req.samples_in_flight
        and not req.draft_token_ids
        and req.num_output_tokens + 1 < req.sampling.max_tokens
        and req.num_tokens + 1 < max_model_len
    )


def grow(req: Request, kv, config) -> bool:
    """Whether R may look ahead and got the ids of its lookahead position p = R.num_tokens
    (the pages and window pages from R.num_computed_tokens through p; no preemption for it)."""
    if not can_look_ahead(req, config.max_model_len):
        return False
    return kv.grow(req, req.num_tokens + 1 - req.num_computed_tokens)


def promote(req: Request) -> None:
    """After commit of R's step in flight: the lookahead step (if any) is the one in flight."""
    req.in_flight_step, req.lookahead_step = req.lookahead_step, None
    req.samples_in_flight = req.in_flight_step is not None
