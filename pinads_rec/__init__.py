"""pinads_rec: ads engagement prediction on TorchRec."""
