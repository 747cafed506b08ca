"""Engine counters gathered from the stages (pure Python)."""


def hisparse_totals(stage_stats: list[dict]) -> dict:
    """Stage HiSparse counters summed over the pipeline, with the hit rate of the hot rows."""
    keys = [k for k in stage_stats[0] if k.startswith("hisparse_")] if stage_stats else []
    out = {k: sum(s.get(k, 0) for s in stage_stats) for k in keys}
    lookups = out.get("hisparse_hits", 0) + out.get("hisparse_misses", 0)
    out["hisparse_hit_rate"] = out.get("hisparse_hits", 0) / lookups if lookups else 0.0
    return out
