"""What the batchplane services share: configuration, domain errors, gRPC plumbing and process
scaffolding. Imports no service package."""
