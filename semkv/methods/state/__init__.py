"""Method state kept beside the KV pool, shared by several methods: rows of batched device tensors (`rows`), per-page
storage that follows the pool (`page_storage`) and per-page key summaries (`page_summaries`)."""
