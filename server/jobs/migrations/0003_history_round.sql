-- The round history is stored here only (before, state.json held a second copy): each job's
-- history names the checkpointed round it was saved with, so a resume drops the records of a
-- round whose checkpoint was never written. NULL: saved before this migration, by an
-- aggregator that wrote state.json first (that state.json still holds the history, and it is
-- what the job resumes from; server/jobs/job_checkpoint.py reads it).
ALTER TABLE job_meta ADD COLUMN history_round INTEGER;
