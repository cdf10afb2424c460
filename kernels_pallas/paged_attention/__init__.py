"""Paged MHA/GQA/MQA attention: decode and chunked prefill."""
