"""rolloutstore's trainer: losses, log-probs, generation, the actor/learner loop."""
