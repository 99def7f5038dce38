"""Clients for Google Cloud APIs (KMS, Secret Manager) over gRPC: adapters other layers share."""
