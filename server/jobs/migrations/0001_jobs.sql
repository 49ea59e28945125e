-- fedgpu aggregator state: jobs, their events and their round history.
-- Applied in order by fedgpu.server.jobstore; PRAGMA user_version records the last one.
CREATE TABLE jobs (
    job_id        TEXT PRIMARY KEY,
    seq           INTEGER NOT NULL UNIQUE,      -- submission order: the queue's order
    name          TEXT NOT NULL,
    task          TEXT NOT NULL,
    state         TEXT NOT NULL,                -- queued|waiting|running|finished|failed|stopped
    reason        TEXT,                         -- why a job waits
    error         TEXT,                         -- why a job failed
    job_toml      TEXT NOT NULL,                -- the file as submitted
    job_json      TEXT NOT NULL,                -- as parsed (Job.to_dict)
    source        TEXT NOT NULL,                -- submit | server-start
    source_sha256 TEXT NOT NULL,                -- of job_toml
    submitted_by  TEXT NOT NULL,
    submitted_at  REAL NOT NULL,
    started_at    REAL,
    finished_at   REAL,
    rounds        INTEGER NOT NULL,
    rounds_done   INTEGER NOT NULL DEFAULT 0,
    accuracy      REAL,
    loss          REAL,
    run_id        TEXT,
    state_dir     TEXT NOT NULL                 -- checkpoints, relative to the state directory
);

CREATE TABLE job_events (
    job_id   TEXT NOT NULL REFERENCES jobs(job_id),
    seq      INTEGER NOT NULL,
    time     REAL NOT NULL,
    level    TEXT NOT NULL,                     -- info|warning|error
    source   TEXT NOT NULL,                     -- aggregator|node
    node     TEXT,
    message  TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);

CREATE TABLE job_rounds (
    job_id      TEXT NOT NULL REFERENCES jobs(job_id),
    idx         INTEGER NOT NULL,               -- position in the job's history
    round       INTEGER NOT NULL,
    status      TEXT NOT NULL,
    record_json TEXT NOT NULL,
    PRIMARY KEY (job_id, idx)
);

CREATE TABLE job_meta (
    job_id      TEXT PRIMARY KEY REFERENCES jobs(job_id),
    initial_eval TEXT,                           -- JSON, the evaluation before round 1
    rejections   TEXT                            -- JSON, refused updates by reason
);
