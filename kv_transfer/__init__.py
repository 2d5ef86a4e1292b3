"""kv_transfer: moving a request's KV from the prefill ranks that hold it to a decode rank."""
