"""The reference model beside every run: what a practitioner would fit first, so a run's AUC says
whether it is any good on data without an oracle (docs/datasets.md, "The reference beside every run").

- ``features``: point-in-time features computed from the built files alone (rates, history
  matches, dense features);
- ``fit``: LightGBM on them, one classifier per task, measured per surface x task by the model's
  own metrics; ``describe`` the lines under the final table;
- ``hook``: fitted when a run ends (``reference.enabled``), into the final table and metrics.jsonl;
- ``cli``: ``python -m pinads_rec.reference --config X [--run DIR]``, the same on its own.
"""
