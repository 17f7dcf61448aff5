"""What prefill and decode workers share: the gRPC plumbing around an engine and a KV store."""
