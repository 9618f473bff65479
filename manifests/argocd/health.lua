-- Argo CD health of a KernelSession (mcpforge.dev/v1alpha1), in Lua 5.1 as Argo CD
-- runs it. A status written for an older generation says nothing about the current
-- spec, so it is Progressing (as kstatus, and so Flux, reads it too). Then:
-- Degraded when the phase is Failed or Expired, or it is Stalled (no progress past its
-- deadline), Suspended when it is Suspended, Healthy when the Ready condition is True,
-- and Progressing otherwise.
local hs = {status = "Progressing", message = "Waiting for the operator"}
local status = obj.status
if status == nil then
  return hs
end
local generation = obj.metadata.generation
if status.observedGeneration == nil or status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready, stalled = nil, nil
if status.conditions ~= nil then
  for _, condition in ipairs(status.conditions) do
    if condition.type == "Ready" then
      ready = condition
    elseif condition.type == "Stalled" then
      stalled = condition
    end
  end
end

local function message(default)
  if ready ~= nil and ready.message ~= nil and ready.message ~= "" then
    return ready.message
  end
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return default
end

local phase = status.phase
if phase == "Failed" or phase == "Expired"
    or (stalled ~= nil and stalled.status == "True") then
  hs.status = "Degraded"
  hs.message = message("KernelSession " .. phase)
  return hs
end
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = message("Suspended: no kernel runs until the session is used or resumed")
  return hs
end
if ready ~= nil and ready.status == "True"
    and (ready.observedGeneration == nil or ready.observedGeneration == generation) then
  hs.status = "Healthy"
  hs.message = message("Kernel ready")
  return hs
end
hs.message = message("Phase " .. tostring(phase))
return hs
