-- release: compare-and-set delete. $1 scope, $2 key, $3 token.
DELETE FROM {{table}}
WHERE scope = $1 AND key = $2 AND token = $3
  AND status = 1 AND expires_at > clock_timestamp()
