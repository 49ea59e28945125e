"""The job contract: the job file's schema and the strategy table (one owner each)."""
