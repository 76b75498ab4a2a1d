-- The outbox table walbox relays in docker-compose.yml (run once by the
-- postgres image when its data directory is created).
CREATE TABLE outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb,
    occurred_at timestamptz NOT NULL DEFAULT now(),
    schema_version int
);
