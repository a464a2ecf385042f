-- delete: whatever the state. $1 scope, $2 key. Returns whether the row
-- was live (or undecodable, which counts as present).
DELETE FROM {{table}}
WHERE scope = $1 AND key = $2
RETURNING (expires_at > clock_timestamp() OR status NOT IN (1, 2)) AS live
