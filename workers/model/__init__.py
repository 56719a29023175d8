"""Model definitions (plain nn.Modules, no request concepts) and their configs."""
