"""The torch.distributed runtime: launch ranks, execute schedules, checkpoint."""
