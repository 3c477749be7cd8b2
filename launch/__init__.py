"""What a user touches: the CLI, the launcher, the frontend, the client, default-model prep."""
