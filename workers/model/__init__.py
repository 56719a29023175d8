"""Model definitions: plain nn.Modules, no request concepts (their config is laneserve/modelspec.py)."""
