"""Online RL inside a training run: REINFORCE/RLOO, rollouts sampled by the policy or served
by a data server, and rewards (a function or a reward model)."""
