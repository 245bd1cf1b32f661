"""The disk tier (``--disk-dir``): one file per object in a directory on this host.

``backend`` (the adapter and a batch's admission within the capacity), ``files`` (one
object's file: naming, reads, writes, removal), ``layout`` (the aligned and packed file
layouts), ``direct_io`` (whole-file aligned I/O), ``index`` (the capacity index and the
directory scan), ``rebuild`` (the index rebuilt at start), ``ledger`` (the byte ledger
every server sharing the directory counts in), ``config`` (``DiskSettings``).
"""
