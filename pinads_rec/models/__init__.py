"""Whole models: plain nn.Modules; parallelism is applied from outside (pinads_rec.parallel)."""
