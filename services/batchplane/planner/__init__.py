"""The planner: one per job. Owns the mixture, the balancing and the ledger of what each step
consumed; never touches sample payloads."""
