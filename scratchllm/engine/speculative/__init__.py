"""Speculative decoding: drafts that the target model verifies several at a time (docs/speculative-decoding.md).

config (SpeculativeConfig, vLLM's and llama.cpp's spellings), ngram (prompt lookup), acceptance
(the greedy and rejection-sampling rules, pure functions), vocabulary (a draft model must have the
target's).
"""
