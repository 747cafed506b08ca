"""A stage's side of prefill/decode disaggregation: its transfer engine and the handoffs' writes
and checks."""
