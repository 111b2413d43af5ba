"""prefill_worker"""
