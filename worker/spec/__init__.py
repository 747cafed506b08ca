"""Speculative decoding on the stages: the draft worker (the MTP layer over its own pools), its
captured passes and chain steps, drafts scheduled before they reach the host, and verification
on the last stage."""
