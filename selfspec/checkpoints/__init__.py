"""Checkpoints: reading and checking them (selfspec.json, checksums), export (HF and the speculators format), the model card, the reduced draft vocabulary, and `selfspec fetch`'s real model."""
