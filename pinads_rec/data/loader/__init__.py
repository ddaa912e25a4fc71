"""The loader: the contract's Parquet files -> checked, shuffled ``Batch``es, one rank's share.

``contract.py`` the column contract (columns, roles, types, ``ContractError``) · ``row_group_checker.py``
the per-row-group checks and repairs · ``rules.py`` the value rules, stated once for the loader, the
build and inspect · ``storage_layout.py`` the two storage layouts and ``Requests`` (how rows are held
in memory) · ``layout_rewrite.py`` a file rewritten in the other layout · ``reader.py`` files, row
groups, schema checks · ``shuffle.py`` the bounded pool of whole requests · ``batch.py`` ``Batch``
and ``BatchBuilder`` · ``dataset.py`` the ``IterableDataset`` composing them and ``make_loader``.
"""
