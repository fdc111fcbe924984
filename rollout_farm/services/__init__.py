"""The rollout service: Ray Serve app, engines, samplers' plumbing, rewards, tasks and the client."""
