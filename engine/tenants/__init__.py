"""Tenants: quotas per cache_salt and tier, the usage ledger, and the quota file. See ledger.py."""
