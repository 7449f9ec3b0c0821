"""The rollout row: its versioned column specification (:mod:`.spec`, built from
``schemas/rollout.v*.json``), reading older schema versions as the newest (:mod:`.compat`),
validation of rows and of multi-turn trajectories (:mod:`.validate`, :mod:`.turns`), and ids
(:mod:`.ids`: UUIDv7 rollout ids, stable prompt ids)."""
