-- Task bundles sent with jobs (README: Your own task). The archive itself is a file in the
-- state directory, bundles/<sha256>.tar (content-addressed: jobs with the same sources share
-- it); these columns reference it. NULL: the job's task is installed on the nodes.
ALTER TABLE jobs ADD COLUMN bundle_sha256 TEXT;
ALTER TABLE jobs ADD COLUMN bundle_size INTEGER;
ALTER TABLE jobs ADD COLUMN bundle_name TEXT;
ALTER TABLE jobs ADD COLUMN bundle_entry TEXT;
