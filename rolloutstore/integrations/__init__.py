"""Integrations with other training frameworks (each imports its framework only when imported).

``rolloutstore.integrations.trl``: ``ReplayGRPOTrainer``, TRL's ``GRPOTrainer`` with a
rollout store as its replay buffer (``pip install 'rolloutstore[trl]'``).
"""
