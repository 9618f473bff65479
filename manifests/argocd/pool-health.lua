-- Argo CD health of a KernelSessionPool (mcpforge.dev/v1alpha1), in Lua 5.1 as Argo CD
-- runs it. A status written for an older generation says nothing about the current
-- spec, so it is Progressing (as kstatus, and so Flux, reads it too). Then: Degraded
-- when the pool is Stalled (its kernels keep failing, or its spec is invalid),
-- Healthy when Ready (filled, or as full as its maximum allows), Progressing otherwise.
local hs = {status = "Progressing", message = "Waiting for the operator"}
local status = obj.status
if status == nil or status.observedGeneration ~= obj.metadata.generation then
  return hs
end
local ready, stalled = nil, nil
for _, c in ipairs(status.conditions or {}) do
  if c.type == "Ready" then
    ready = c
  elseif c.type == "Stalled" then
    stalled = c
  end
end
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.message or stalled.reason or "stalled"
  return hs
end
if ready ~= nil then
  hs.message = ready.message or ready.reason or hs.message
  if ready.status == "True" then
    hs.status = "Healthy"
  end
end
return hs
