"""The directory's HTTP API and its KV-event subscriptions (`kvdepot directory`)."""
